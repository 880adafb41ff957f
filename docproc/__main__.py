from docproc.cli import main

main()
