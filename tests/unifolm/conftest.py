"""Fixtures shared by the UnifoLM tests: one tiny golden checkpoint folder and its loaded model per test
process, and one `unifolm-tiny` pipeline (its programs compile once, not once per module)."""

import pytest
from unifolm_golden import write_tiny


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    return write_tiny(str(tmp_path_factory.mktemp("unifolm") / "tiny"))


@pytest.fixture(scope="session")
def tiny_model(tiny_folder):
    from wan_tpu.unifolm.loading import load_unifolm

    return load_unifolm(tiny_folder)
