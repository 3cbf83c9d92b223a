"""Read the scalars a run wrote to TensorBoard, with TensorBoard's own event reader."""

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_scalar_events(run_dir) -> dict[str, list[tuple[float, int, float]]]:
    """{tag: [(wall_time, step, value), ...]} in file order; purged steps (resumed runs) are dropped."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} in file order."""
    return {tag: [(s, v) for _, s, v in events] for tag, events in read_scalar_events(run_dir).items()}


def event_files(run_dir) -> list[Path]:
    return sorted(Path(run_dir).glob("events.out.tfevents.*"))
