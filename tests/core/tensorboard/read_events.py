"""TensorBoard's own reader over a folder of event files (the reference for loom's writer):
writes {tag: [[step, value], ...]} as JSON to OUT.
usage: read_events.py FOLDER OUT"""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})  # 0: keep every point
acc.Reload()
with open(sys.argv[2], "w") as f:
    json.dump({tag: [[e.step, e.value] for e in acc.Scalars(tag)]
               for tag in acc.Tags()["scalars"]}, f)
