"""Command line: train the bundled default pair. The code is tests/fixtures/tiny_training.py (the tests build on it too);
run with --help for the options."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures.tiny_training import main  # noqa: E402

if __name__ == "__main__":
    main()
