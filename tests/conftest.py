import pathlib, pytest
@pytest.fixture(scope="session")
def smollm2_gguf():
    return pathlib.Path("/tmp/smolgguf/SmolLM2-135M-Instruct.Q4_1.gguf")
