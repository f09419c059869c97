"""torchrun, with its failure summary kept as data for `opadvisor profile --nproc-per-node`.

    python -m opadvisor.profile._dist_launch FAILURES.json TORCHRUN_ARGS...

Runs `torch.distributed.run` (its own argument parser and launch) in this process. When a rank fails,
torchrun raises ChildFailedError, which its `main` would print as a long traceback; here the failures
(per global rank: local rank, exit code, signal, pid) go to FAILURES.json for the launcher to word, and
the exit code is 1, as torchrun's. Stopped by a signal (the launcher's Ctrl-C), it exits 128 + signal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    failures_path, torchrun_args = Path(argv[0]), argv[1:]
    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as exc:
        failures = {
            str(rank): {
                "local_rank": f.local_rank,
                "exit_code": f.exitcode,
                "signal": f.signal_name() if f.exitcode < 0 else None,
                "pid": f.pid,
            }
            for rank, f in exc.failures.items()
        }
        failures_path.write_text(json.dumps(failures), encoding="utf-8")
        return 1
    except SignalException as exc:  # SIGTERM/SIGINT to the launcher: torchrun has stopped its ranks
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
