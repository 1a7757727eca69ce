"""Graph passes on the joint graph, one module per job: :mod:`.tag_regions` (the tagging
pass), :mod:`.saving_rules` (what it saves beyond the policy), :mod:`.hop_bodies`
(higher-order-op bodies). Importing them loads Inductor (the pass subclasses its
``CustomGraphPass``): the backend imports them on its first compile."""
