from deploy.bench import main

main()
