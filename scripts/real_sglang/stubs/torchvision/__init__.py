from _cpu_stub import install

install(__name__, "0.24.1")
