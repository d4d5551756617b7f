"""Engine adapters of the node (DESIGN.md section 8): plain Python, torch and transformers.

``base`` is the interface a node's worker calls, ``reference`` its implementation on a
transformers Llama model, ``modeldir`` the reference model directory, ``samplers`` the
resumable samplers of session checkpoints (spec 6.8). Nothing here imports Django.
"""
