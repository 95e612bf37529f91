"""The launcher's read of the checkpoints into the page cache while Ray and Serve start
(deployments/prefetch.py, DEEPSEEK_OCR_PREFETCH_CHECKPOINT)."""
import os

import pytest

from deployments import __main__ as launcher
from deployments import prefetch


def test_checkpoint_dirs_named_by_a_config_or_an_import_path(tmp_path):
    first, second = tmp_path / "ocr", tmp_path / "ocr2"
    first.mkdir(), second.mkdir()
    config = tmp_path / "serve.yaml"
    config.write_text(f"""
applications:
- name: one
  import_path: deployments.app:build
  args: {{checkpoint: {first}}}
- name: both
  import_path: deployments.app:build
  args:
    checkpoint: {first}
    models: [{{name: a}}, {{name: b, checkpoint: {second}}}, {{name: c, checkpoint: {tmp_path / 'missing'}}}]
- name: tiny
  import_path: deployments.app:app
""")
    assert prefetch.checkpoint_dirs([str(config)]) == [str(first), str(second)]
    assert prefetch.checkpoint_dirs(["deployments.app:build", f"checkpoint={second}", "max_batch=8"]) == [str(second)]
    assert prefetch.checkpoint_dirs(["deployments.app:app"]) == []
    assert prefetch.checkpoint_dirs([str(tmp_path / "absent.yaml")]) == []  # serve run says why
    broken = tmp_path / "broken.yaml"
    broken.write_text("applications: [")
    assert prefetch.checkpoint_dirs([str(broken)]) == []
    assert prefetch.checkpoint_dirs([]) == []


def test_prefetch_reads_the_files_replicas_read(tmp_path, monkeypatch):
    sizes = {"model-00001-of-00002.safetensors": 3_000_001, "model-00002-of-00002.safetensors": 17,
             "config.json": 120, "tokenizer.json": 4_000}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(os.urandom(size))
    (tmp_path / "README.md").write_text("not read")
    monkeypatch.setattr(prefetch, "READ_BYTES", 1 << 20)  # several reads a file
    assert prefetch.checkpoint_files(str(tmp_path))[0].endswith("model-00001-of-00002.safetensors")
    assert prefetch.prefetch([str(tmp_path)]) == sum(sizes.values())
    # Files over half the available memory would push each other out: left to the replicas.
    monkeypatch.setattr(prefetch, "available_memory_bytes", lambda: 2 * sum(sizes.values()) - 2)
    assert prefetch.prefetch([str(tmp_path)]) == 0


def test_start_runs_it_in_a_process_of_its_own(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    assert prefetch.start([]) is None
    process = prefetch.start([str(tmp_path)])
    assert process.wait(timeout=60) == 0


@pytest.mark.parametrize("switch", ["0", "1"])
def test_the_launcher_starts_it_before_serve_run_when_switched_on(tmp_path, monkeypatch, switch):
    config = tmp_path / "serve.yaml"
    config.write_text(f"applications:\n- {{import_path: deployments.app:build, args: {{checkpoint: {tmp_path}}}}}\n")
    started, ran = [], []
    monkeypatch.setenv("DEEPSEEK_OCR_PREFETCH_CHECKPOINT", switch)
    monkeypatch.setattr(prefetch, "start", started.append)
    monkeypatch.setattr(os, "execve", lambda path, argv, env: ran.append(argv[-2:]))
    launcher.main([str(config)])
    assert started == ([[str(tmp_path)]] if switch == "1" else [])
    assert ran == [["run", str(config)]]
