"""Run a training script unchanged and, as its `main()` returns, save what that rank holds (tests only).

    torchrun --standalone --nproc_per_node=2 tests/rank_state_dump.py cleanrl_ddp/SCRIPT.py [flags...]

With RANK_STATE_DUMP_DIR set, every rank writes `rank{RANK}.pt`: the state dict of each `nn.Module`
and the value of each int in `main`'s local variables at the moment it returns. The script runs as
`__main__` through runpy and has no hooks of its own; the locals are observed from outside with
`sys.setprofile`, so the tests compare ranks on what the script really ended with.
"""

import os
import runpy
import sys

import torch


def main() -> None:
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    path = os.path.join(os.environ["RANK_STATE_DUMP_DIR"], f"rank{os.environ.get('RANK', '0')}.pt")

    def on_event(frame, event, arg):
        code = frame.f_code
        if event == "return" and code.co_name == "main" and code.co_filename == script:
            state = {}
            for name, value in frame.f_locals.items():
                if isinstance(value, torch.nn.Module):
                    state[name] = {k: v.detach().cpu().clone() for k, v in value.state_dict().items()}
                elif type(value) is int:  # not bool, nor IntEnum members such as signal numbers
                    state[name] = value
            torch.save(state, path)

    sys.setprofile(on_event)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
