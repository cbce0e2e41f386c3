"""The tutorial notebooks run top to bottom on CPU with 2 engines (nbclient, real kernel)."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import fsdp_nb

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))

EXPECTED = {
    # what each notebook must show: text a broken session, wrap or recovery would change
    "01_quickstart": ["rank 0 of 2 on cpu", "rank 1 of 2 on cpu", "final loss"],
    "02_checkpoints": ["valid, world_size=2", "(2, {'step': 5},", "({'step': 5}, True)",
                       "resized 3 -> 2 ranks in", "model 'model' re-sharded with optimizer",
                       "world size 2 same weights: True"],
    "03_large_model": ["full model:", "planned peak", "cheapest change that fits", "what if",
                       "rank 0: step ok", "rank 1: step ok"],
    "04_failures": ["caught:", "rank 1 found bad data", "interrupted; session state: ready",
                    "rank(s) 1", "all_reduce after recovery: 1.0",
                    # the status widget's log, printed at the end
                    "execute failed (rank 1): rank 1: RuntimeError: rank 1 found bad data",
                    "execute interrupted (rank 0", "restart recovered: rank(s) 1 replaced",
                    # a hang explained while it waits, then ended by the straggler; a mismatch
                    "rank 1 is not in it: in data_step (cell line 4): time.sleep(0.05)",
                    "fsdp_nb: execute: the collective completed",
                    "mismatch on the default group (different collectives): rank 0 in all_reduce #"],
    "05_workflow": ["no kernel attached, keep_alive", "attached: 2 ranks, models ['model']",
                    "same weights: True", "[rank 1] step 2 on rank 1", "reloaded on ranks [0, 1]",
                    "[rank 1] version 2, edited", "(Pdb rank 1) p scaled\ntensor([nan, nan, nan, nan])",
                    "[rank 1] rank 1 batch sum: 0.0", "sessions left: []"],
    "06_huggingface": ["'config.json'", "auto_wrap=ClassNames(names=('LlamaDecoderLayer',))",
                       "[rank 0] step 4: loss", "'config.json', 'generation_config.json', 'model.safetensors'",
                       "read back: LlamaForCausalLM same weights: True"],
}


def _shown(nb) -> str:
    """Everything the executed notebook shows as text: streams and text/plain results."""
    parts = []
    for c in nb.cells:
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            parts.append(o.get("text", ""))
            parts.append(o.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    # its own IPYTHONDIR: the sessions a notebook keeps alive are found (and stopped) there
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    scratch = tmp_path / "tmp"  # the kernel's and its engines' temporary folder: emptied by the end
    scratch.mkdir()
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=180,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
        store_widget_state=True,
        # the tutorials are the CPU path (2 gloo engines): hide any GPU from the
        # kernel and the engines it starts, so the suite passes on a GPU machine too
        env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TMPDIR=str(scratch)),
    )
    try:
        client.execute()  # raises CellExecutionError on the first failing cell
    finally:
        for left in fsdp_nb.sessions():  # a notebook that failed half-way: stop what it kept
            fsdp_nb.Session.attach(left.cluster_id, activate=False).shutdown()
    left_here = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("ipython", "tmp"))
    assert left_here == [], f"{path.name} left scratch files where it ran: {left_here}"
    left_in_tmp = sorted(p.name for p in scratch.iterdir())
    assert left_in_tmp == [], f"{path.name} left files in its temporary folder: {left_in_tmp}"
    shown = _shown(nb)
    missing = [text for text in EXPECTED[path.stem] if text not in shown]
    assert not missing, f"{path.name} did not show {missing}"
