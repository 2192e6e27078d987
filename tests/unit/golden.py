"""Golden sha256 of each sample message in test_codec.py. Regenerate only with a PROTOCOL_VERSION bump."""

GOLDEN_SHA256 = {
    "submit:r1": "2f3eb785c0b4de57de387842a534e2feb9c504229a65f50abaea0ca884d6d7af",
    "submit:r2": "a0cefca8d115082fab5a822f3fb9d4e5639064b90846d0b9889964e86bcdf389",
    "abort": "b440be41900d6908d34925cba87d2778af756df2ae3e0d1c2066c17dacba6899",
    "evict": "d50a01f5d8c65f718920a145cd6839f1915a3d11724e7ce60d89d87ffe8ced87",
    "progress": "402dca2ede6433544718e7ec23cd8d378a5001df037a25af4cd2accb6648b998",
    "standby": "60753ecd86fdb3e95d7e4d95bf5bb1899d661139b1c85d925593f915aaa71a25",
    "load": "ca1a05fb168b09ddfad4630d124a5cee4bf8d11e5e1a4ffece67752644cbde4c",
    "ready": "862516f2a6c1888b9f999b3bc14fa3c9ad858c9e277c09b1564f11c512259dc2",
    "tokens": "809cf7c14825bd9a28e4b5f92040e825fc037e774d136491e8c3181b58ac4b0e",
    "finished": "0189ae02407c008b7823716387514d0945371923fbfc02e10e64424a4e6d3f4d",
    "failed": "7d252d25dceddb20d5e3e3a0c89ef0409f570f0afc2589760e39ae29c0a68abb",
    "heartbeat": "0a747fbed00999df4d2990a8446e8556fa8f41cfff83ab12a647ad7d5a97baba",
    "step_started": "dff15fd8269712cd58f8fd7f7e8504029ed32332708117f6155ca38b8ae17491",
    "clear_cache": "ab7f18b658bedf23763514b082754fc619a8c93dc52bb549f6e39e80c1f2f868",
    "cache_stats": "fdcc2c97399d310697873788932dd064b6d7f0642fe936fe2613d4da4fb888eb",
    "cache_cleared": "5a06b62efd195642d8532cce322728b266e96315a575b2d3660dc00b5b3e7108",
    "bye": "bf77ac9d47dbc76ab5d951f90bb1529558a3a9e8102ff67015dc3ecd4d6df6f9",
}
