"""The `reward.sandbox` section: how programs in responses are run to score them (code execution rewards).

verl sends code to a remote Sandbox Fusion service (`reward_model.sandbox_fusion.url`,
`max_concurrent`, `memory_limit_mb`); conveyor runs it on the reward worker's own
machine in a local sandbox, under the same `max_concurrent` and `memory_limit_mb`
names and the limits a local process needs besides.

It deliberately builds no sandbox: `conveyor.tasks.sandbox` does, from these keys,
in the reward worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config.fields import F, registry

__all__ = ["SandboxConfig"]


@dataclass
class SandboxConfig:
    """Code execution for rewards that run the response (e.g. data.synthetic.task=code); see docs/rewards.md."""

    isolation: str = F(
        "auto",
        "auto (namespaces where the kernel allows them, else rlimits), namespaces (required), or rlimits alone "
        "(no network, file or process isolation: see docs/RELIABILITY.md)",
        choices=registry("conveyor.tasks.sandbox", "ISOLATION_MODES"),
    )
    max_concurrent: int = F(4, "programs run at once by each reward worker (verl's sandbox_fusion key)", ge=1, le=1024)
    timeout_s: float = F(10.0, "wall-clock seconds one program may run before its processes are killed", gt=0, le=3600)
    cpu_limit_s: float = F(5.0, "CPU seconds one program may use (RLIMIT_CPU)", gt=0, le=3600)
    memory_limit_mb: int = F(1024, "address space of each process, in MB (verl's sandbox_fusion key)", ge=64)
    max_processes: int = F(16, "processes and threads the program may have at once (RLIMIT_NPROC)", ge=1, le=4096)
    max_open_files: int = F(64, "open file descriptors per process (RLIMIT_NOFILE)", ge=16, le=65536)
    max_output_mb: float = F(1.0, "largest file the program may write, its stdout and stderr included", gt=0, le=1024)
    disk_limit_mb: int = F(16, "size of the program's own folder, all files together (with namespaces)", ge=1)
    python: str | None = F(None, "interpreter that runs the programs; null = the trainer's base interpreter")
    user: int = F(
        65534,
        "uid (and gid) the programs run as when the trainer runs as root (nobody; programs running at once take the "
        "uids below it, one each, so no two share RLIMIT_NPROC); ignored otherwise",
        ge=1,
        hint="never 0: the programs must not run as root",
    )
