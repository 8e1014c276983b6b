"""The engine loop: schedule -> run the model -> sample -> process outputs, one `Engine.step()` at a time.

`engine.py` wires the pieces; `input_processor.py` validates a prompt and its parameters into a `Request`;
`scheduler.py` picks each step's tokens (plain Python); `model_runner.py` turns a step into tensors and runs
the model; `sampler.py` picks tokens from logits; `output_processor.py` turns tokens into text and decides
when a request stops; `scoring.py` runs teacher-forced scoring over the steps.
"""
