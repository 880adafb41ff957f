from docproc.cli import entry

entry()
