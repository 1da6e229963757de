from aotbuild.cli import main

main()
