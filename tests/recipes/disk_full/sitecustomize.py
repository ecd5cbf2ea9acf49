"""Loaded at start-up by every Python process that has this folder on PYTHONPATH (the resume tests put it
there for one torchrun job). NUMLOSS_TEST_DISK_FULL="RANK:STEP" makes that rank's `torch.save` of a file
of checkpoint STEP write half of it and then fail with ENOSPC, as a write to a full disk does; every other
process and file is untouched."""

import os

_spec = os.environ.get("NUMLOSS_TEST_DISK_FULL", "")
_rank, _, _step = _spec.partition(":")
if _spec and os.environ.get("RANK") == _rank:
    import errno

    import torch

    _real_save, _target = torch.save, f"step_{int(_step):08d}"

    def _save_to_a_full_disk(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and _target in os.fspath(f):
            _real_save(obj, f, *args, **kwargs)
            os.truncate(f, os.path.getsize(f) // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(f))
        return _real_save(obj, f, *args, **kwargs)

    torch.save = _save_to_a_full_disk
