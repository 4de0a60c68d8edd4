"""Writes `chats_dataset_dict/`: what `load_dataset(...).save_to_disk(DIR)` leaves for a chat
dataset with a train and a test split (test_direct_inputs.py converts its train split).

Run once with the real `datasets` (not a test dependency), from this folder:
    uv run --no-project --with datasets python make_dataset_dict.py
"""

if __name__ == "__main__":
    import datasets

    def chat(a: int, b: int) -> dict[str, list[dict[str, str]]]:
        return {
            "messages": [
                {"role": "user", "content": f"{a}+{b}="},
                {"role": "assistant", "content": str(a + b)},
            ]
        }

    print("datasets", datasets.__version__)
    train = datasets.Dataset.from_list([chat(a, 7) for a in range(10, 16)])
    test = datasets.Dataset.from_list([chat(a, 9) for a in range(10, 12)])
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk("chats_dataset_dict")
