from kvlm.cli.main import run

run()
