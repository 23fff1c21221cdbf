"""Under the Triton interpreter, install the contract suite's interpreter speed-up for these tests too."""

from lowlat.platform import triton_interpreter_enabled

if triton_interpreter_enabled():
    from lowlat_contract import interpreter

    interpreter.install()
