"""DeepSpeed's training monitor: the config's "tensorboard", "csv_monitor" and "wandb" sections. Rank 0 of the
job writes each event ``(name, value, x)`` to every enabled writer, with DeepSpeed's names and file layout, so
that a ported config's curves land where a DeepSpeed run puts them; the engines decide which events (a step's
lr and loss scale, the pipeline's losses; docs/ENGINE.md, "Monitoring"). Writers flush every event.
"""

from __future__ import annotations

import csv
import os

from .._C import Zero8NotSupportedError


def _missing(cfg, key: str, package: str, err: Exception) -> Zero8NotSupportedError:
    return Zero8NotSupportedError(
        f"{cfg.source}: {key}.enabled: true needs the {package} package, which cannot be imported here ({err}): "
        f"pip install {package}, or disable {key}")


def _log_dir(section) -> str:
    """output_path/job_name of a "tensorboard" or "csv_monitor" section, made if missing."""
    path = os.path.join(section.output_path, section.job_name)
    os.makedirs(path, exist_ok=True)
    return path


class CsvWriter:
    """One file per event name in output_path/job_name: the name with '/' and ' ' as '_', plus ".csv", with a
    header row ("step", the name's last '/' part) before this run's first row of it, as DeepSpeed's csvMonitor
    (which appends to a file a previous run left, header included)."""

    def __init__(self, section):
        self.log_dir = _log_dir(section)
        self._started: set[str] = set()

    def write(self, events) -> None:
        for name, value, x in events:
            stem = name.replace("/", "_").replace(" ", "_")
            # Opened per row, so a crash loses nothing written before it.
            with open(os.path.join(self.log_dir, stem + ".csv"), "a", newline="") as f:
                out = csv.writer(f)
                if stem not in self._started:
                    self._started.add(stem)
                    out.writerow(["step", name.split("/")[-1]])
                out.writerow([x, value])

    def close(self) -> None:
        pass


class TensorBoardWriter:
    """torch's SummaryWriter on output_path/job_name: one scalar per event, flushed after each batch of events."""

    def __init__(self, cfg):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise _missing(cfg, "tensorboard", "tensorboard", e) from e
        self.writer = SummaryWriter(log_dir=_log_dir(cfg.tensorboard))

    def write(self, events) -> None:
        for name, value, x in events:
            self.writer.add_scalar(name, value, x)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """A wandb run (wandb.init with project, group and entity=team, as DeepSpeed's); each event is one log call
    at step x. WANDB_MODE=offline and the other WANDB_* variables apply as to any wandb run."""

    def __init__(self, cfg):
        try:
            import wandb
        except ImportError as e:
            raise _missing(cfg, "wandb", "wandb", e) from e
        w = cfg.wandb
        self.run = wandb.init(project=w.project, group=w.group, entity=w.team)

    def write(self, events) -> None:
        for name, value, x in events:
            self.run.log({name: value}, step=x)

    def close(self) -> None:
        self.run.finish()


class Monitor:
    """DeepSpeed's engine.monitor: ``enabled`` when the config enables a monitor zero8 writes (the same on every
    rank, so that collectives feeding an event run everywhere); ``write_events([(name, value, x), ...])`` writes
    on the job's rank 0 and does nothing elsewhere. A writer whose package is missing fails here, at
    initialize (Zero8NotSupportedError naming the key and the package), not at the first step."""

    def __init__(self, cfg, rank: int):
        self.enabled = bool(cfg.tensorboard.enabled or cfg.csv_monitor.enabled or cfg.wandb.enabled)
        self._writers: list = []
        if not self.enabled or rank != 0:
            return
        try:
            if cfg.tensorboard.enabled:
                self._writers.append(TensorBoardWriter(cfg))
            if cfg.wandb.enabled:
                self._writers.append(WandbWriter(cfg))
            if cfg.csv_monitor.enabled:
                self._writers.append(CsvWriter(cfg.csv_monitor))
        except BaseException:
            self.close()
            raise

    @property
    def writes(self) -> bool:
        """Whether this process writes the events (the job's rank 0 with a monitor enabled)."""
        return bool(self._writers)

    def write_events(self, events) -> None:
        for w in self._writers:
            w.write(events)

    def close(self) -> None:
        """Closes the writers (engine.destroy(), and so at exit); later events are dropped."""
        writers, self._writers = self._writers, []
        for w in writers:
            w.close()
