"""The mode of the files a run hands to its users (the export in `final/`): the one any new file gets
under the process's umask (0644 under the usual 022), for every file alike.

safetensors (0.7 on) writes a file through a private temporary file and renames it, so the weights it
writes are 0600 while the config, index and tokenizer files beside them are 0644: another user of a
shared cluster (or a serving container running as another uid) can read the config of an export but
not its weights. `give_default_mode` sets every file of a directory to the default mode before the
export is switched in.
"""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """This process's umask, read without changing it where Linux says it (/proc/self/status); elsewhere
    set and restored at once (a thread creating a file in between would see umask 0)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode `open(path, "w")` gives a new file here."""
    return 0o666 & ~umask()


def give_default_mode(directory: Path) -> None:
    """Every file under `directory` (recursively) to `default_file_mode()`."""
    mode = default_file_mode()
    for root, _, files in os.walk(directory):
        for name in files:
            os.chmod(os.path.join(root, name), mode)
