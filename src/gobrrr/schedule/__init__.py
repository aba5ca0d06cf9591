"""The step's timeline: the host issuing ops, the GPU's streams running them (`streams`), the
scheduler that places every op (`scheduler`), and the power limit's fixed point over it
(`power`)."""
