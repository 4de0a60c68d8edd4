"""Writes `chats_save_to_disk/` from `chats.jsonl`: the `datasets.save_to_disk` folder that
test_convert.py converts beside the JSONL itself.

Run once with the real `datasets` (not a test dependency), from this folder:
    uv run --no-project --with datasets python make_save_to_disk.py
The middle row has no `id`, which Arrow stores as a null the reader must drop.
"""

import json
from pathlib import Path

if __name__ == "__main__":
    import datasets

    rows = [json.loads(line) for line in Path("chats.jsonl").read_text().splitlines()]
    print("datasets", datasets.__version__)
    datasets.Dataset.from_list(rows).save_to_disk("chats_save_to_disk")
