"""The ``ray`` backend: one Ray actor per group, on one machine or a cluster. ``backend`` (the
driver's side and the registration), ``actor`` (the actor), ``plan`` (connecting and placing
the actors). Importing this package imports no ``ray``; its modules do."""
