"""`python -m experiments.generate`: what it refuses before anything trains. The trained
workdirs answering prompts are in tests/test_generate_command_integration.py."""

from __future__ import annotations

import pytest

from experiments import generate


def test_a_directory_without_a_run_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json not found"):
    generate.restore_params(str(tmp_path))
