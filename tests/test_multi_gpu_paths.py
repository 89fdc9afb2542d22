"""The multi-GPU paths, proven on the CPU (issue 39): compile under DDP in a real 2-process gloo
run, an FSDP launch refused in one line, fp16's loss scaler (`GradScaler("cpu")`) through the
real step and its checkpointed state, bf16 detection and CUDA RNG states with patched
`torch.cuda`, the resolved augmentation mode recorded and compared on resume, `train.tf32`."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from conftest import pipeline
from test_pipelines import ROOT, pretrain_args, rows

from ssl_vit.config import ConfigError, PretrainConfig
from ssl_vit.data import device_augment
from ssl_vit.train import plan, rng, runtime
from ssl_vit.train.loop import BadSteps, Resumed, new_counters
from ssl_vit.train.optim import build_adam
from ssl_vit.train.step import TrainStep

# --- 1. torch.compile under DDP: a real 2-process gloo run ---------------------------------

# Runs pipelines/pretrain.py's main with a counting eager backend (cheap on the CPU), then
# writes this rank's Dynamo counters: compiled graphs and graph breaks.
DRIVER = textwrap.dedent(
    """
    import json, os, runpy, sys
    import torch
    from torch._dynamo.utils import counters
    import ssl_vit.model.compile as compile_mod
    graphs = []
    def backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward
    compile_mod.BACKEND = backend
    main = runpy.run_path(sys.argv[1])["main"]
    main(sys.argv[2:])
    run_dir = [a.split("=", 1)[1] for a in sys.argv if a.startswith("output_dir=")][0]
    out = os.path.join(run_dir, f"dynamo_rank{os.environ['RANK']}.json")
    with open(out, "w") as f:
        json.dump({"graphs": len(graphs), "breaks": sum(counters["graph_break"].values())}, f)
    """
)
LAUNCH = [
    *(sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes"),
    *("2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(driver, shards, out, compile_on: bool) -> subprocess.Popen:
    run = ["train.steps=4", "train.log_every=1", "train.checkpoint_every=0"]
    cmd = [
        *LAUNCH,
        *("--main_process_port", str(_free_port()), str(driver)),
        str(ROOT / "pipelines/pretrain.py"),
        *pretrain_args(shards, out, *run, f"compile.enabled={str(compile_on).lower()}"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.system
def test_compile_under_ddp_two_processes(synthetic_shards, tmp_path):
    """Eager and compiled 2-process runs (side by side: the start-up dominates): the compiled
    one runs its compiled step on both ranks, one graph each, no fallback line, same losses."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    procs = [_two_processes(driver, synthetic_shards, d, d is compiled) for d in (eager, compiled)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "torch.compile of" not in outs[1][1]  # no fallback-to-eager line on any rank
    for rank in (0, 1):
        dynamo = json.loads((compiled / f"dynamo_rank{rank}.json").read_text())
        print(f"rank {rank}: {dynamo}")
        assert dynamo["graphs"] >= 1 and dynamo["breaks"] == 0
        assert json.loads((eager / f"dynamo_rank{rank}.json").read_text())["graphs"] == 0
    a, b = [r["loss"] for r in rows(eager)], [r["loss"] for r in rows(compiled)]
    assert len(a) == len(b) == 4
    diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    print("eager", a, "\ncompiled", b, "\nmax |diff|", diff)
    assert b == pytest.approx(a, rel=1e-5, abs=1e-6)


def test_step_compiles_the_module_inside_ddp(monkeypatch):
    """The step compiles the module DDP wraps (DDP's own forward is never handed to Dynamo)."""
    from torch.nn.parallel import DistributedDataParallel

    inner = torch.nn.Linear(3, 1)
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # no process group needed
    torch.nn.Module.__init__(ddp)
    ddp.module = inner
    opt = torch.optim.SGD(inner.parameters(), lr=0.1, fused=True)
    forward = inner.forward
    step = TrainStep(ddp, opt, lambda x: ddp.module(x).sum(), 1.0, compile=True)
    assert type(inner.forward).__name__ == "Compiled" and inner.forward.fn == forward
    assert type(step.forward).__name__ == "function"  # the closure itself stays eager


# --- 2. FSDP: one error line naming DDP ----------------------------------------------------


def test_fsdp_launch_is_one_line(monkeypatch, synthetic_shards, tmp_path):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` sets for FSDP
    with pytest.raises(SystemExit) as e:
        pipeline("pretrain")(pretrain_args(synthetic_shards, tmp_path / "run"))
    line = str(e.value)
    assert line == f"error: {runtime.FSDP_REFUSED}" and "\n" not in line
    assert "DDP" in line and "configs/accelerate/8gpu.yaml" in line
    assert not (ROOT / "configs/accelerate/fsdp_8gpu.yaml").exists()
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    with pytest.raises(ConfigError, match="FSDP is not supported"):
        runtime.refuse_fsdp(DistributedType.FSDP)  # an Accelerator that came up as FSDP
    runtime.refuse_fsdp(DistributedType.MULTI_GPU)


# --- 3. fp16: the loss scaler through the real step ----------------------------------------


def _fp16_step(seed: int = 0):
    """The real TrainStep through a real Accelerator with a CPU GradScaler (what Accelerate
    makes for fp16 on CUDA): its backward scales, its clip unscales, its optimizer steps
    through the scaler. forward(x, k): loss = k * mean(model(x)^2)."""
    acc = Accelerator(cpu=True)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    cfg = PretrainConfig().train
    model, opt = acc.prepare(model, build_adam(model, cfg))
    step = TrainStep(model, opt, lambda x, k: k * model(x).pow(2).mean(), 1.0, acc=acc)
    return acc, model, opt, step


def _batches(n: int) -> list[tuple[torch.Tensor, float]]:
    """n batches; the 2nd has a loss factor of 1e36: a finite loss whose gradients overflow
    at scale 2^16 (fp32 max 3.4e38): the scaler's case."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), 1e36 if i == 1 else 1.0) for i in range(n)]


def test_fp16_overflow_is_a_scaler_skip_not_a_bad_step(tmp_path):
    acc, model, opt, step = _fp16_step()
    counters = new_counters()
    bad = BadSteps(3, tmp_path, counters, torch.device("cpu"))
    x = torch.randn(8, 4)
    for k in (1.0, 1e36, 1e36, 1e36, 1e36, float("nan"), 1.0):  # 4 overflows, 1 NaN loss
        step(x, k)
        bad.update(step.applied, step.scaler_skipped)
    bad.check(7)  # 4 overflows in a row (> max_bad_steps 3): not a bad run
    assert counters["scaler_skips"] == 4 and counters["skipped_steps"] == 1
    assert acc.scaler.get_scale() < 2.0**16  # the scaler handled them: its scale went down


def test_fp16_scaler_state_is_saved_and_restored_bit_exact():
    batches = _batches(6)
    acc, model, opt, step = _fp16_step()
    for x, k in batches:  # uninterrupted
        step(x, k)
    final, final_scale = [p.detach().clone() for p in model.parameters()], acc.scaler.get_scale()
    acc, model, opt, step = _fp16_step()
    for x, k in batches[:3]:
        step(x, k)
    saved = torch.load(_roundtrip(model, opt, acc), weights_only=True)  # as a checkpoint
    assert saved["scaler"]["scale"] not in (None, 2.0**16)  # the overflow lowered it
    acc, model, opt, step = _fp16_step(seed=7)  # resumed: other weights until restored
    start = Resumed(3, rng=rng.rng_state(), state=saved, path="step_00000003")
    start.restore(SimpleNamespace(acc=acc), model, opt)  # weights, optimizer, loss scale
    for x, k in batches[3:]:
        step(x, k)
    assert acc.scaler.get_scale() == final_scale
    for p, q in zip(model.parameters(), final, strict=True):
        assert torch.equal(p, q)  # bit-exact


def _roundtrip(model, opt, acc):
    import io

    buf = io.BytesIO()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scaler": acc.scaler.state_dict(),  # as Checkpoints.save records it
    }
    torch.save(state, buf)
    buf.seek(0)
    return buf


# --- 4. mixed_precision auto: native bf16 only, asked of this process's own device ---------


@pytest.mark.parametrize(("capability", "expected"), [((7, 0), "no"), ((8, 0), "bf16")])
def test_auto_precision_native_bf16_on_own_device(monkeypatch, capability, expected):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda d: asked.append(d) or capability
    )

    def no_context(*args, **kwargs):
        raise AssertionError("allocates on a device (creates a CUDA context)")

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", no_context)
    monkeypatch.setattr(torch.cuda, "current_device", no_context)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert runtime.resolve_mixed_precision("auto") == expected
    assert asked == [3]  # rank 3's own GPU, never cuda:0


# --- 5. data.augment: the resolved mode is recorded and compared on --resume ---------------


def test_resume_onto_another_augmentation_is_one_line(monkeypatch, synthetic_shards, tmp_path):
    out = tmp_path / "run"
    args = pretrain_args(synthetic_shards, out, "train.steps=2", "train.checkpoint_every=1")
    pipeline("pretrain")(args)  # data.augment=auto on the CPU: workers
    saved = torch.load(out / "checkpoints/step_00000002/rng_rank0.pt", weights_only=True)
    assert saved["augment"] == {"mode": "workers"}
    # The same run resumed on a GPU, where auto resolves to device augmentation:
    monkeypatch.setattr(plan, "resolve_augment", lambda augment, device: "device")
    with pytest.raises(ConfigError) as e:
        pipeline("pretrain")([*args, "train.steps=4", "--resume"])
    line = str(e.value)
    assert "\n" not in line and line.startswith("data.augment:")
    assert "'workers'" in line and "'device'" in line and "data.augment=workers" in line


# --- 6. train.tf32 -----------------------------------------------------------------------


def test_tf32_key_sets_both_flags(monkeypatch):
    assert PretrainConfig().train.tf32 is True  # default as before
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32

    class OnCuda:  # what make_accelerator reads of the Accelerator on a GPU
        def __init__(self, **kwargs):
            self.device, self.distributed_type = torch.device("cuda"), DistributedType.NO

    monkeypatch.setattr(runtime, "Accelerator", OnCuda)
    try:
        for enabled in (False, True):
            runtime.make_accelerator("no", tf32=enabled)
            flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
            assert flags == (enabled, enabled)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


# --- 7. CUDA RNG: this process's own device only (issue 38) --------------------------------


def test_cuda_rng_state_is_this_devices_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d: torch.tensor([10 + d]))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda t, d: calls.append((t.item(), d)))
    for name in ("get_rng_state_all", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: pytest.fail("all devices touched"))
    state = rng.rng_state()
    assert state["cuda"].tolist() == [11]
    rng.set_rng_state(state)
    assert calls == [(11, 1)]


def test_device_augment_takes_no_generator_state_of_another_device():
    aug = device_augment.DeviceAugment(8, torch.Generator().manual_seed(0), (0.5, 1.0))
    before = aug.generator.get_state()
    aug.load_state_dict({"mode": "device", "generator": torch.zeros(16, dtype=torch.uint8)})
    assert torch.equal(aug.generator.get_state(), before)  # a CUDA-sized state: ignored
