"""``python -m frod_ds.cli COMMAND ...``: ``frod`` for launchers that run a module (torchrun -m, deepspeed
--module, srun python -m)."""

from frod_ds.cli.main import console

if __name__ == "__main__":
    console()
