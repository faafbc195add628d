from pagedllm.entrypoints.cli.main import main

main()
