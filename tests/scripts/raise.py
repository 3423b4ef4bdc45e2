import mpilearn

mpilearn.init()
raise ValueError("boom")
