from sparsedecode.cli import main

main()
