"""The policy pack's code: self-contained (its data in ../data, nothing imported from the
project), so that `pulumi policy publish` ships a pack that runs wherever it is installed."""
