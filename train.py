"""scalelab's single entrypoint: `python train.py [group=option ...] [key=value ...]`.

Examples:
    python train.py                                  # tiny model, embedded corpus, CPU
    python train.py model=xl precision=bf16 attention_impl=sdpa compile=true benchmark.enabled=true
    python train.py -m mesh=dp1,dp2 parallelism=ddp_bucketed,zero1,fsdp model=small
"""
import os
import sys
import traceback
from pathlib import Path

import hydra
from omegaconf import DictConfig

# Started by torchrun (or SLURM+submitit) every rank runs this file; only rank 0 may
# create Hydra's output directory, and all ranks must share it (hydra #2070): send the
# other ranks' Hydra bookkeeping to a scratch directory; the trainer broadcasts rank 0's.
if int(os.environ.get("RANK", "0")) > 0 and not any(a.startswith(("-m", "--multirun")) for a in sys.argv[1:]):
    sys.argv += [f"hydra.run.dir={os.environ.get('TMPDIR', '/tmp')}/scalelab_rank{os.environ['RANK']}",
                 "hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]

import core.config  # noqa: E402,F401 - registers the config resolvers before Hydra composes
from core.errors import ConfigError  # noqa: E402

CONFIG_DIR, CONFIG_NAME = Path(__file__).resolve().parent / "conf", "config"


@hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base="1.3")
def main(cfg: DictConfig):
    from launchers.job import run_job

    try:
        return run_job(cfg)
    except Exception:  # not bad input (run_job exits with code 2 for that): a failure to debug
        traceback.print_exc()  # the whole chain; Hydra's own report would keep only the last message
        raise SystemExit(1) from None


if __name__ == "__main__":
    from core.errors import exit_on
    from launchers.preflight import check_command_line

    try:  # Hydra would report a composition mistake in many lines, with exit code 1
        check_command_line(sys.argv[1:], str(CONFIG_DIR), CONFIG_NAME)
    except ConfigError as e:
        exit_on(e)
    main()
