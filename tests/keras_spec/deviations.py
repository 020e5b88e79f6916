"""The README's deliberate deviations from Keras' own tests, by node id under `keras/src/`.

Read by `swap_plugin` (strict `xfail`s) and by `run.py`, which checks before the run that each
still names a test of the installed Keras.
"""

REASONS = {
    2: "deviation 2: bad loss keys fail at compile, not in fit",
    3: "deviation 3: BackupAndRestore(save_freq=N) resumes mid-epoch",
}
_LOSS_KEYS = "models/model_test.py::ModelTest::test_functional_"
DEVIATIONS = {
    _LOSS_KEYS + "dict_outputs_dict_losses_invalid_keys": 2,
    _LOSS_KEYS + "list_outputs_dict_losses_invalid_keys": 2,
    _LOSS_KEYS + "list_outputs_dict_losses_no_output_names": 2,
    "callbacks/backup_and_restore_test.py::BackupAndRestoreCallbackTest::test_best_case_step": 3,
}
