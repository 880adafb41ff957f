"""Command line: synthetic invoices and receipts with ground truth. The code is tests/fixtures/documents.py (the tests build on it too);
run with --help for the options."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures.documents import main  # noqa: E402

if __name__ == "__main__":
    main()
