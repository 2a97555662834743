"""Query capture: the post-RoPE queries of a request's last W prompt tokens, out of vLLM.

plan       QueryRun: the window rows a step computes, as paged slots
scheduler  which requests ask, their window's slots per step, the in-flight bound
worker     the per-step attention impl.forward layer, row gathers, partial windows
support    whether capture can run here (setting, vLLM release, CUDA graphs)
"""
