"""The take pipeline every take shares: target and settings, plan, write requests and their
scheduler, the commit protocol, and the Session that carries state from one take to the next.
"""
