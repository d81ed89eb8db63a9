"""The piecewise compile backend: split the traced graph at the splitting ops (``split``),
run each piece per token range (``runtime``), compile or load it through a compiler adaptor
(``compiler``, with Inductor's lean warm-start form in ``inductor_lean``), and save the
program skeleton (``graph_serde``) so a warm start skips Dynamo (``backend``).

It drives the artifact cache and the pass manager through the Protocols in ``protocols``
and imports neither."""
