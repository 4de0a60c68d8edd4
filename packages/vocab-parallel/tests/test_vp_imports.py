from train_testing.import_graph import assert_no_import_cycles


def test_modules_import_each_other_without_a_cycle() -> None:
    # Every import counts, function-local and TYPE_CHECKING ones too: they hide a cycle.
    assert_no_import_cycles("vocab_parallel")
