from kvlm.cli import run

run()
