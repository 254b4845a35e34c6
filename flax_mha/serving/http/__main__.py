"""`python -m flax_mha.serving.http --checkpoint DIR`: see `flax_mha.serving.http.cli`."""

from flax_mha.serving.http import cli

if __name__ == "__main__":
  cli.main()
