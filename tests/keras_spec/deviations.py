"""The README's deliberate deviations from Keras' own tests, by node id under `keras/src/`.

Read by `swap_plugin` (strict `xfail`s) and by `run.py`, which checks before the run that each
still names a test of the installed Keras.
"""

REASONS = {
    1: "deviation 1: non-finite steps are skipped, so a NaN loss never reaches the logs",
    2: "deviation 2: bad loss keys fail at compile, not in fit",
    3: "deviation 3: BackupAndRestore(save_freq=N) resumes mid-epoch",
}
_NAN = "callbacks/terminate_on_nan_test.py::TerminateOnNaNTest::"
_LOSS_KEYS = "models/model_test.py::ModelTest::test_functional_"
DEVIATIONS = {
    _NAN + "test_TerminateOnNaN": 1,
    _NAN + "test_raise_error_terminate_does_not_trigger_on_train_end": 1,
    _NAN + "test_raise_error_terminate_preserves_backup": 1,
    _NAN + "test_raise_error_terminate_stops_on_later_batch": 1,
    _NAN + "test_terminate_on_nan_raise_error_raises_error": 1,
    "callbacks/csv_logger_test.py::CSVLoggerTest::test_stop_training_csv": 1,
    _LOSS_KEYS + "dict_outputs_dict_losses_invalid_keys": 2,
    _LOSS_KEYS + "list_outputs_dict_losses_invalid_keys": 2,
    _LOSS_KEYS + "list_outputs_dict_losses_no_output_names": 2,
    "callbacks/backup_and_restore_test.py::BackupAndRestoreCallbackTest::test_best_case_step": 3,
}
