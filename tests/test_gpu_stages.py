"""The GPU check's stages (scripts/gpu_check.sh runs `python -m minigrpo.bench.gpu_stages STAGE`), each run here at
a CPU's size, so that no line of the check runs for the first time on a card (its float16 stage once imported a
name that had moved, and ended after three steps of training without checking anything)."""

import json

import pytest
import torch

from minigrpo.bench import gpu_stages
from minigrpo.bench.decode import depth_only
from minigrpo.model import byte_tokenizer


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    folder = depth_only("smollm2-135m", tmp_path_factory.mktemp("tiny") / "model", layers=2)
    byte_tokenizer().save_pretrained(folder)  # the stages load a tokenizer beside the weights
    return folder


def test_decode_speed_reports_both_loops_per_row_count(tiny_folder, capsys):
    assert gpu_stages.main(["decode-speed", tiny_folder, "2", "2 4"]) == 0
    figures = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(f["rows"], f["path"]) for f in figures] == [(2, "static"), (2, "eager")]


def test_decode_correct_checks_each_dtype_once(tiny_folder, capsys):
    """`auto` is the same dtype as one asked for by name (float16 on a T4; float32 here): checked once."""
    assert gpu_stages.main(["decode-correct", tiny_folder, "2", "4", "auto", "float32"]) == 0
    passed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("PASS: ")]
    assert len(passed) == 5, passed


def _run_folder(tmp_path, gap: float):
    from safetensors.torch import save_file

    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    steps = [{"step": s, "frac_groups_reward_differs": 0.5, "sampler_logprob_gap/mean": gap, "mem/peak_gb": 1.0}
             for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    save_file({"base_model.model.layers.0.q_proj.lora_B.weight": torch.ones(4, 2)},
              str(run / "adapter" / "adapter_model.safetensors"))
    return str(run)


def test_first_run_checks_pass_a_healthy_run_and_fail_a_stale_generator(tmp_path, capsys):
    assert gpu_stages.main(["first-run-checks", _run_folder(tmp_path / "good", 0.001)]) == 0
    assert capsys.readouterr().out.count("PASS: ") == 4
    assert gpu_stages.main(["first-run-checks", _run_folder(tmp_path / "stale", 0.3)]) == 1
    assert "FAIL: the generator samples with the updated adapter" in capsys.readouterr().out


def test_export_memory_reports_the_streamed_export(tiny_folder, tmp_path, capsys):
    assert gpu_stages.main(["export-memory", tiny_folder, str(tmp_path / "export")]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(figures) == {"device", "dtype", "exported_gb", "largest_shard_gb", "extra_device_gb"}
    assert figures["largest_shard_gb"] <= figures["exported_gb"] and list((tmp_path / "export").glob("*.safetensors"))
    assert (tmp_path / "export" / "model.safetensors.index.json").exists()


def test_an_unknown_stage_is_named():
    with pytest.raises(SystemExit, match="unknown stage 'nope'"):
        gpu_stages.main(["nope"])


def test_the_doctors_engine_starts_eager(monkeypatch):
    """The doctor's engine only checks: compiling and capturing CUDA graphs took it past its 60 s (float16: 30 s)
    stage limit on a T4, so it starts without them."""
    pytest.importorskip("vllm")
    from minigrpo.cli import doctor
    from minigrpo.generate.vllm_engine import VLLMGenerator

    asked = {}

    def start(*args, **kwargs):
        asked.update(kwargs)
        raise RuntimeError("stopped here")

    monkeypatch.setattr(VLLMGenerator, "start", start)
    checks = doctor.check_engine(None, None, torch.float32, on_gpu=False)
    assert asked["eager"] is True and checks[0].status == doctor.FAIL
