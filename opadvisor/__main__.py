from opadvisor.cli import main

main()
