"""The order of this process's prints beside its tap functions' lines, as JAX's
synchronous callbacks would have had it: stdout.py (a write to stdout first lets the
callbacks of the computations dispatched so far run), ipython.py (a notebook cell's
callbacks show in that cell), bars.py (a progress bar closes after the callbacks that
update it). tapd.emitter.lifecycle hooks them, handing them its waits; none imports it.
"""
