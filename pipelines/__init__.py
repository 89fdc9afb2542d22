"""The three jobs, read top to bottom: pretrain, finetune, fewshot. Run them as scripts from a
checkout (`python pipelines/pretrain.py ...`), or installed as `ssl-vit pretrain ...` /
`accelerate launch -m ssl_vit.pipelines.pretrain ...` (the wheel ships this folder as
`ssl_vit.pipelines`)."""
