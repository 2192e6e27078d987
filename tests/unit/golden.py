"""Golden sha256 of each sample message in test_codec.py. Regenerate only with a PROTOCOL_VERSION bump."""

GOLDEN_SHA256 = {
    "submit:r1": "97856532f94dc3e13015fffc76152cbffe795a91cc1f4992e11188add2c2fe49",
    "submit:r2": "29bc288f93f91f9784980e8356564b40ea2248bb3974bc9d571c76931c84ca9a",
    "abort": "8327aea20c128b8124415e42c90aed48616826bb9ae1ac8baed846861c138692",
    "evict": "3dbc8757451e1dd42ebf510dbf8f74bcb2c7b50570d812d8da38688af594e91e",
    "progress": "3afeb558be446b0bb29f0bcf2f060e8d76e138229b8c746e47faed3d190da478",
    "ready": "7375b24de830c67905d0550cb29f7e1fb69d028ed9f342f7713d7177c24baacf",
    "tokens": "671b0a663441f1571350bb0487f0c43f5172ee7dbf1175becc3ab2e658cd6b0f",
    "finished": "4586f543df6ed61aaeb0dc9f597fa369b22c0a4b185409f75e2b7d6c21d166a8",
    "failed": "31c41ced56715b61caef8df5f34dfad5c610a2238fa67a4290ea059bd1430b84",
    "heartbeat": "a1dea44adf9debb7a38c47cd74afe800511905b20c9892ea814244e1e16f8423",
    "bye": "eddde40fc4e59cab7eebb91b865b6c32e865d50f7c41e26fb8e5ced1d970cc5d",
}
