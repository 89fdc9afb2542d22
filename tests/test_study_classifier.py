"""configs/study/classifier.yaml: its variants are valid pretraining configs in both presets and
plan the chains issue 22 asks for (the `recipes` key is the cls-ft branch's: dropped here)."""

import shlex
from pathlib import Path

import yaml
from test_study import load_study

from ssl_vit.config import PretrainConfig, StudyConfig, from_dict, load_config

REPO = Path(__file__).resolve().parents[1]


def test_classifier_study_plans_valid_chains(tmp_path, capsys):
    raw = yaml.safe_load((REPO / "configs/study/classifier.yaml").read_text())
    assert [r["name"] for r in raw.pop("recipes")] == ["paper", "modern"]
    cfg = from_dict(StudyConfig, raw)
    assert [v.name for v in cfg.variants] == ["paper_mpp", "mpp_decoder", "visible_75"]
    paper = cfg.variants[0].objective
    assert (paper.decoder_depth, paper.encoder, paper.mask_ratio) == (0, "all", 0.5)
    copy = tmp_path / "classifier.yaml"
    copy.write_text(yaml.safe_dump(raw))
    study = load_study()
    for preset in ("quick", "gpu"):
        out = f"{preset}.output_dir={tmp_path / preset}"
        study.main(["--config", str(copy), "--preset", preset, "--dry-run", out])
        plan = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[plan]")]
        names = [ln.split(":")[0].removeprefix("[plan] ") for ln in plan]
        assert names[:2] == ["fewshot/random", "finetune/scratch"]
        assert names.count("pretrain/visible_75") == 1 and len(names) == 2 + 3 * 3
        for line in plan:
            argv = shlex.split(line.split(": ", 1)[1])
            if "pipelines/pretrain.py" in argv[1]:  # every override a valid pretraining config
                overrides = [a for a in argv[2:] if "=" in a and not a.startswith("-")]
                pre = load_config(PretrainConfig, None, overrides)
                want = {"paper_mpp": (0, "all"), "mpp_decoder": (2, "all")}
                got = (pre.objective.decoder_depth, pre.objective.encoder)
                assert got == want.get(Path(pre.output_dir).name, (2, "visible"))
            if "pipelines/fewshot.py" in argv[1]:
                assert "fewshot.shots=[1, 5, 10, all]" in argv and "fewshot.layers=all" in argv
