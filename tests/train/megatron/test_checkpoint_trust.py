"""Contract pinned (issue 30.15): docs/reliability.md says a megatron (torch_dist) checkpoint is NOT safe against a
crafted file, because its `.metadata` index is unpickled without restriction when it is resumed. This test confirms
that claim on the installed torch, with a real `torch.distributed.checkpoint` directory: if a torch release starts
loading the index safely, this test fails and the guarantee in the docs can be widened."""

import pickle

import torch
import torch.distributed.checkpoint as dcp


class _RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_torch_dist_index_is_unpickled_so_a_crafted_one_runs_code(tmp_path):
    ckpt = tmp_path / "step_1"
    dcp.save({"w": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(str(ckpt)), no_dist=True)
    index = ckpt / ".metadata"
    assert index.is_file(), sorted(p.name for p in ckpt.iterdir())
    # The real index loads: the reader the megatron backend's resume goes through reads exactly this file.
    loaded = {"w": torch.zeros(4)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)
    assert torch.equal(loaded["w"], torch.arange(4.0))

    marker = tmp_path / "code-ran"
    index.write_bytes(pickle.dumps(_RunsCodeWhenUnpickled(marker)))
    try:
        dcp.FileSystemReader(str(ckpt)).read_metadata()
    except Exception:  # noqa: BLE001 - what it returns is not metadata; what matters is that the code already ran
        pass
    assert marker.exists(), "torch no longer unpickles the torch_dist index freely: update docs/reliability.md"
