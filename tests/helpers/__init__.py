"""What the tests share, in one importable place: tiny models and policy parameters (``models``), the
toy tokenizer (``tokenizer``), engine requests and checks (``engine``), a live server (``serve``)
and a calibration run folder (``calibration``). Tests import these from here, never from another
test module or a conftest; conftest files hold only fixtures."""
