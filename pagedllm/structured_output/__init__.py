"""Structured output: the sampled tokens of a request follow a grammar (JSON schema, regex, EBNF).

    request arrives       backend.compile(params)        InputProcessor, off the engine thread (the server:
                                                         compile_pool's processes); compiled grammars cached
    EngineCore.add_request RequestGrammar(compiled)      a matcher: this request's place in its grammar
    Scheduler.schedule    fill_bitmask(requests)         which tokens each constrained row may take next
                                                         (and after each draft token: speculative decoding)
    ModelRunner           apply_bitmask(logits)          the rest get -inf, before penalties and sampling
    update_from_output    grammar.accept(token)          a finished grammar stops the request

Constrained and free requests share a step: only the constrained rows are masked. xgrammar (the
grammar engine vLLM uses by default) does the compiling and matching.
"""
