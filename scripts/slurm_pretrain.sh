#!/usr/bin/env bash
# Pretraining on a SLURM cluster: one `accelerate launch` per node, which starts one process per
# GPU. Submit with e.g.  sbatch --nodes=2 scripts/slurm_pretrain.sh configs/pretrain/vit_b16.yaml
# Extra arguments after the config are key=value overrides. Preemption: SLURM sends SIGTERM
# (--signal below gives 120 s of warning); the job finishes its step, checkpoints and exits 0,
# and --requeue restarts it with --resume from that checkpoint.
#SBATCH --job-name=ssl-vit-pretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one launcher per node
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --signal=B:TERM@120
#SBATCH --requeue
#SBATCH --output=slurm-%j.out
set -euo pipefail

CONFIG=${1:?usage: sbatch scripts/slurm_pretrain.sh CONFIG [key=value ...]}
shift
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-8}
MAIN_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MAIN_PORT=${MAIN_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# srun starts the launcher once per node; SLURM_NODEID is that node's rank. The launchers
# forward signals to the training processes.
srun --kill-on-bad-exit=1 bash -c "
  exec accelerate launch \
    --multi_gpu \
    --num_machines $SLURM_NNODES \
    --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
    --machine_rank \$SLURM_NODEID \
    --main_process_ip $MAIN_HOST \
    --main_process_port $MAIN_PORT \
    --mixed_precision bf16 \
    --rdzv_backend static \
    --same_network \
    pipelines/pretrain.py --config $CONFIG --resume $*
" &
PID=$!
# --signal=B:TERM reaches this batch shell only: pass it on to srun (which signals the tasks),
# then wait for the checkpoint to be written.
trap 'kill -TERM $PID' TERM INT
wait $PID || wait $PID
