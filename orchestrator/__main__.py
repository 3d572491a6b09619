from orchestrator.server import main

main()
