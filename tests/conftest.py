# =====================================================================================================
# hub_server fixture: a local Hugging Face Hub-compatible server (tests/hub_server.py) that the real
# huggingface_hub client talks to through HF_ENDPOINT. Self-contained block: keep it together when
# adding other fixtures to this file.
# =====================================================================================================
import pytest


def _hub_server_module():
    try:  # tests/ on sys.path (pytest's default "prepend" import mode, no tests/__init__.py)
        import hub_server
    except ImportError:  # tests/ is a package
        from tests import hub_server
    return hub_server


@pytest.fixture
def hub_server(tmp_path, monkeypatch):
    """A started HubServer (token "hf_test_token", user "test-user") with huggingface_hub pointed at it.

    Sets HF_ENDPOINT, HF_TOKEN, HF_HOME/HF_HUB_CACHE (under tmp_path), HF_HUB_DISABLE_TELEMETRY=1,
    HF_HUB_ENABLE_HF_TRANSFER=0, HF_HUB_DISABLE_XET=1 (clients >= 1.x pick Xet on their own when hf_xet is
    installed; this server only speaks LFS), unsets HF_HUB_OFFLINE, and patches the values huggingface_hub
    copied from the environment at import time (huggingface_hub.constants.*, huggingface_hub.hf_api.api).
    """
    mod = _hub_server_module()
    server = mod.HubServer(tmp_path / "hub-server-data").start()
    try:
        mod.configure_hf_client(monkeypatch, server.url, tmp_path / "hf-home", server.token)
        yield server
    finally:
        server.stop()


# ===================================== end of hub_server fixture =====================================
