"""The protocol faces (FACES.md): the same runs, spoken as other software already speaks.

``follow`` is what every face shares (a run's events, live, until it ends or waits; the chats and
threads of the client's ids); each protocol has its own package of translation and routes.
"""
